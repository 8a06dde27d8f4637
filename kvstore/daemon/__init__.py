"""The `kvstore serve` daemon: HTTP server over a ChunkStore, its wire protocol, client and CLI."""
