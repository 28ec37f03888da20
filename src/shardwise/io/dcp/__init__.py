"""The distributed save in rank-local safetensors (``sharded_write``): every rank writes its own
regions. Reading that format, and everything about torch DCP folders, is the format plugins'
(``shardwise.io.formats.sharded``, ``shardwise.io.formats.dcp``)."""
