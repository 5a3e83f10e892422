"""From chunks to stored objects: the chunk container, encryption at rest, and the tier that checks every byte."""
