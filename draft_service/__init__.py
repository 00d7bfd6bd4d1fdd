"""The DSpark draft service (dspark.v1.DraftService, protos/dspark/v1/draft.proto): it keeps each target session's
context and proposes draft chains or trees (the DSpark drafter, DDTree, prompt lookup, hybrid) for the target to
verify."""
