"""siirl_dag: a declarative DAG workflow engine for RL post-training of LLMs."""

__version__ = "0.1.0"
