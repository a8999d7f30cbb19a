from engine.process import exit_process, prepare_process

prepare_process()  # before the commands' imports load PyTorch's OpenMP runtime

from engine.cli import main  # noqa: E402

exit_process(main())
