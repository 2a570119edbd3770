"""Tree-training launcher (the ``megatron-tree-train`` command; see ``megatron_tree/train``).

    python examples/train_tree.py --config configs/tiny_qwen3.yaml                 # one process
    torchrun --nproc-per-node 2 examples/train_tree.py --config configs/tiny_qwen3.yaml --tp 2
    python examples/train_tree.py --help                                           # every flag
"""

import sys

from megatron_tree.train.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
