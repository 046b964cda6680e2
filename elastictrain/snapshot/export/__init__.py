"""Export of a verified snapshot's model (and optimizer) as one consolidated file.

``api.export`` picks the snapshot, a source reads its tensors one at a time
(``replicated.py``: a torch payload; ``sharded.py``: DCP chunks assembled into full
tensors), a writer places each into a ``safetensors`` or ``torch.load``-able file
(``writers.py``), and the file appears under its name only once the snapshot verified
(``output.py``). What the file holds and how its names are made: ``contents.py``;
docs/export.md.
"""
