"""Safetensors files as shardwise writes and reads them, shared by every format that stores
safetensors: headers and region reads, the streaming writer, file plans and indexes
(``format``); the transformers hub key layouts, read (``hub_layout``) and written
(``hub_save``) through region math. The ordinary safetensors checkpoint format itself is the
plugin ``shardwise.io.formats.safetensors``."""
