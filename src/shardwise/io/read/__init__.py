"""The read floor, under every format: the region reader (``reader``: a rank's boxes of each
tensor, batched, on threads), byte boxes of a file (``mapped``: private mmap views and preads,
:func:`~shardwise.io.read.mapped.read_region`), and the reads a job shares (``fetch`` and
``exchange``: a storage read once per job, its bytes exchanged; ``replicas``: each region read
by one dp replica), run in the mode the load decides (``modes``). A format says which bytes;
this floor reads them over a storage. It imports no format and no pipeline."""
