"""`python -m dspark_grpc.bench ...` is `dspark bench ...`."""

import sys

from dspark_grpc.bench.cli import main

main(command=["python", "-m", "dspark_grpc.bench", *sys.argv[1:]])
