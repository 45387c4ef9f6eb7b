"""The ``hf-lowprec`` command line (installed as the package ``hf_lowprec.cli``)."""
