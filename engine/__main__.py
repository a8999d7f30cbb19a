import sys

from engine.process import prepare_process

prepare_process()  # before the commands' imports load PyTorch's OpenMP runtime

from engine.cli import main  # noqa: E402

sys.exit(main())
