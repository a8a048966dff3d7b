#!/usr/bin/env python
"""Train with Parle on Horovod. See README.md and `python train.py --help`.

    horovodrun -np 2 -H localhost:2 python train.py --config configs/fashion_parle.yaml
"""

from parle_hvd.cli import exit_now, main

if __name__ == "__main__":
    exit_now(main())      # main's exit status, without Python's ~1 s of freeing torch's modules
