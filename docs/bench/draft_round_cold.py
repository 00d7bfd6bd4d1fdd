"""The draft service's handling of a decode round in process, on one thread, with warm or cold caches: the shipped
drafter (fast precision, its compiled chain), a session of 60-600 context rows, rounds of 2 appended rows (random
bf16 features: timing only) and a proposal. `--flush-mb 64` writes a 64 MB buffer before each round, as the
target's forward does between two rounds when both services share the cores. Prints the medians of the round's
handling (`DraftServicer.handle`) and of the proposal's compute_seconds. Usage:

    PYTHONPATH=. .venv/bin/python docs/bench/draft_round_cold.py [--flush-mb 64] [--rounds 400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from dspark_grpc.draft_service.engine import DraftEngine
from dspark_grpc.draft_service.servicer import DraftServicer
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2
from dspark_grpc.runtime.kernels.cpu_kernels import default_compile_cache
from dspark_grpc.serving.sessions import Owner
from dspark_grpc.serving.tensor_codec import rows_to_proto

FIRST_ROWS, LAST_ROWS, NEW_ROWS = 60, 600, 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flush-mb", type=int, default=0, help="MB written before each round (0: warm caches)")
    p.add_argument("--rounds", type=int, default=400)
    args = p.parse_args()
    torch.set_num_threads(1)  # the draft service's default
    cache = default_compile_cache()
    os.environ.setdefault("DSPARK_COMPILE_CACHE", str(cache))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    engine = DraftEngine.load("embedded", None, precision="fast", compile="max", compile_cache=cache, progress=False)
    servicer = DraftServicer(max_message_bytes=64 << 20, max_sessions=4)
    servicer.engine = engine
    owner, c, fingerprint = Owner("bench"), engine.config, engine.target_fingerprint
    g = torch.Generator().manual_seed(0)
    ids = iter(range(1, 1 << 62))

    def ok(**op) -> draft_pb2.DraftSessionResponse:
        out = servicer.handle(draft_pb2.DraftSessionRequest(request_id=next(ids), **op), owner)
        assert not out.status.code, out.status
        return out

    def append(start: int, n: int) -> draft_pb2.DraftSessionRequest:
        rows = (torch.randn(n, len(c.target_layer_ids), c.target_hidden_size, generator=g) * 2).to(torch.bfloat16)
        capture = common_pb2.HiddenCapture(layer_ids=c.target_layer_ids, start_position=start,
                                           rows=rows_to_proto([rows]))
        tokens = torch.randint(100, 20000, (n,), generator=g).tolist()
        return draft_pb2.DraftSessionRequest(append=draft_pb2.AppendContext(
            session_id="s", start_position=start, tokens=tokens, capture=capture))

    ok(open=draft_pb2.OpenDraft(target=common_pb2.Fingerprint(model=fingerprint[0], tokenizer=fingerprint[1]),
                                session_id="s"))
    ok(append=append(0, FIRST_ROWS).append)
    flush = torch.zeros(args.flush_mb * (1 << 20) // 4)
    length, handled, computed = FIRST_ROWS, [], []
    for _ in range(args.rounds):
        ops = [append(length, NEW_ROWS), draft_pb2.DraftSessionRequest(propose=draft_pb2.Propose(
            session_id="s", anchor_token=123, anchor_position=length + NEW_ROWS))]
        length += NEW_ROWS
        flush.add_(1.0)  # evicts the caches (a no-op at 0 MB)
        t0 = time.perf_counter()
        out = ok(round=draft_pb2.DraftRound(ops=ops))
        handled.append(time.perf_counter() - t0)
        computed.append(out.round.results[1].proposal.compute_seconds)
        if length > LAST_ROWS:
            ok(truncate=draft_pb2.TruncateContext(session_id="s", length=FIRST_ROWS))
            length = FIRST_ROWS
    h, pc = statistics.median(handled[50:]), statistics.median(computed[50:])
    print(f"flush {args.flush_mb} MB: round handled in {1e3 * h:.2f} ms, of which the proposal {1e3 * pc:.2f} ms "
          f"(other {1e3 * (h - pc):.2f} ms)")


if __name__ == "__main__":
    main()
