"""Hostile input corpus: paths, options, archives and requests built to break
podshim. Each case gets its documented gRPC code and message, podshim stays up, and nothing
outside the allowed checkpoint roots is read or written."""
