"""Real inference engines run beside the gateway: vLLM's CPU build, a tiny model, a fleet.

Nothing here imports `gateway`: these modules start engines as separate processes (from their
own virtual environment) so that tests and `make run-real` can put the gateway in front of them.
"""
