#!/usr/bin/env python
"""Train with Parle on Horovod. See README.md and `python train.py --help`.

    horovodrun -np 2 -H localhost:2 python train.py --config configs/fashion_parle.yaml
"""
import sys

from parle_hvd.cli import main

if __name__ == "__main__":
    sys.exit(main())
