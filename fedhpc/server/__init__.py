"""Server-side pieces of a round that every algorithm can use (channel model, server trainer)."""
