"""An emulated vLLM replica for demos, tests and benchmarks without a GPU (docs/emulator.md);
its cache and time model are pure, so the replay drives them in virtual time.

Nothing is imported here: the gateway's command line reads the emulator's flags
(`emulator.config`) at every start, and should not load the emulator's server to do so.
"""
