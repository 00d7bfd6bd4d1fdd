"""The DSpark draft service (dspark.v1.DraftService). Its protocol is defined in protos/dspark/v1/draft.proto;
the drafter itself is built in a later issue."""
