"""The main job under Slurm (recipes/slurm/), on a local cluster in network namespaces (tests/slurm_cluster.py)."""
