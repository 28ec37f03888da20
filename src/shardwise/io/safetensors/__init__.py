"""Safetensors files as shardwise writes and reads them, shared by every format that stores
safetensors: headers and region reads, the streaming writer, file plans and indexes
(``format``, ``sink``). The ordinary safetensors checkpoint format itself is the plugin
``shardwise.io.formats.safetensors``; the transformers hub key layouts are the Hugging Face
adapter's (``shardwise.hf``)."""
