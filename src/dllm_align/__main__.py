"""``python -m dllm_align`` (also ``accelerate launch -m dllm_align train ...``)."""

from dllm_align.cli.app import main

if __name__ == "__main__":
    main()
