"""hetpipe: pipeline-parallel LLM pretraining across mixed AMD + NVIDIA clusters.

Pipeline stages sit on vendor-homogeneous groups (NCCL on NVIDIA, RCCL on AMD);
only stage boundaries that cross a vendor line go through hetpipe's own
channel. See docs/architecture.md.
"""
__version__ = "0.1.0"
