"""This process: the torch it runs (torch_compat: the supported range and every private
torch name; known_warnings: torch's warnings about what hetpipe does on purpose), its
place in a launch (rank_env: rank, world size, restart attempt) and its injected faults
(faults, for tests). Ground floor (docs/architecture.md, "Layers"): every layer may
import it. Nothing is imported here, so reading the rank environment loads no torch.
"""
