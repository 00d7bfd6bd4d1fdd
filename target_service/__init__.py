"""The target service (dspark.v1.TargetService, protos/dspark/v1/target.proto): it runs the target model, and steps
its sessions with or without its drafter.

- `step_engine.py`: one speculative step, top to bottom (plan -> draft -> verify and commit -> report), and the
  session operations around it; what Generate and the TargetSession stream both call.
- `engine.py`: the model's sessions (KV cache, prefill, batched verify, commit, captures), no speculation.
- `draft_rounds.py`, `drafter_link.py`, `drafter_pool.py`: the rounds with the draft service, its health, a pool.
- `servicer.py`: protobuf <-> the two engines; `http_front.py`: the OpenAI-compatible HTTP front; `cli.py`:
  `dspark-target`.
"""
