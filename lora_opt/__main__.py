"""``python -m lora_opt``: the ``lora-opt`` command line."""
import sys

from lora_opt.cli import main

sys.exit(main())
