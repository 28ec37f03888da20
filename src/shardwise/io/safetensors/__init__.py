"""The ordinary safetensors format: headers, region reads through the page cache, the streaming
writer, checkpoint folders and indexes, and the hub key layouts read through region math."""
