"""One DraftSession request's round trip to a real draft service, over its gRPC stream and over its session socket
(`GetDrafterInfoResponse.session_socket`), the two interleaved: a request the service answers at once (a truncate
of a session it does not know: NOT_FOUND, in band), so the figure is the transport's and the threads' cost, not the
drafter's. Prints the median and 90th percentile of each. Usage:

    PYTHONPATH=. .venv/bin/python docs/bench/session_socket_rtt.py [--calls 500]
"""

from __future__ import annotations

import argparse
import statistics
import time

import grpc
from dspark_grpc.client.local_stack import local_drafter
from dspark_grpc.protos.dspark.v1 import draft_pb2, draft_pb2_grpc
from dspark_grpc.speculation.channel import SessionStream, SocketSessionStream


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=500)
    args = p.parse_args()
    with local_drafter(["--drafter", "none"]) as address:
        stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(address))
        while True:  # SERVING once the engine is up
            try:
                info = stub.GetDrafterInfo(draft_pb2.GetDrafterInfoRequest())
                break
            except grpc.RpcError:
                time.sleep(0.2)
        streams = {"gRPC stream": SessionStream(stub.DraftSession, None),
                   "session socket": SocketSessionStream(info.session_socket, draft_pb2.DraftSessionResponse)}
        request = draft_pb2.DraftSessionRequest(request_id=1, truncate=draft_pb2.TruncateContext(session_id="none"))
        seconds: dict[str, list[float]] = {name: [] for name in streams}
        for i in range(args.calls + 50):
            for name, stream in streams.items():
                t0 = time.perf_counter()
                assert stream.call(request, 30).status.code == grpc.StatusCode.NOT_FOUND.value[0]
                if i >= 50:  # after a warm-up
                    seconds[name].append(time.perf_counter() - t0)
        print("| transport | median, us | 90th percentile, us |\n|---|---|---|")
        for name, s in seconds.items():
            print(f"| {name} | {1e6 * statistics.median(s):.0f} | {1e6 * sorted(s)[int(0.9 * len(s))]:.0f} |")
        for stream in streams.values():
            stream.close()


if __name__ == "__main__":
    main()
