"""``python -m hf_lowprec.cli``: the ``hf-lowprec`` command."""

from hf_lowprec.cli.app import main

main()
