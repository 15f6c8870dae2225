"""`python -m onnxgrad ...`, and `torchrun --nproc-per-node N -m onnxgrad train ...`: the command line."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
