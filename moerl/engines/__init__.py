"""Rollout engines behind one client: SGLang servers on GPUs, or moerl's embedded engine that speaks
the same HTTP protocol on CPU or GPU."""
