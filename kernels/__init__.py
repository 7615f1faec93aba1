"""Attention kernels behind one dispatch point.

The model's attention layers call ``paged_attention`` (write the step's K/V into the paged cache,
then attend through the block tables). On CPU this is the plain-torch reference in
``reference.py``; Triton kernels for CUDA plug in here and are tested against that reference.
The model runner builds the ``AttentionMetadata`` once per step (``metadata.py``).
"""

from pdserve.kernels.metadata import AttentionMetadata, DecodeBatch, PrefillSeq
from pdserve.kernels.reference import paged_attention, write_to_cache

__all__ = ["AttentionMetadata", "DecodeBatch", "PrefillSeq", "paged_attention", "write_to_cache"]
