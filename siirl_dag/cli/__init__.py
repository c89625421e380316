"""One module per sub-command of `python -m siirl_dag.main`; each has main(args) -> exit status."""
