"""Examples of extending shoal (serializer families with side channels, ...)."""
