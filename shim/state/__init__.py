"""podshim's durable state: the journal of in-flight operations (docs/architecture.md §16 (Crash safety))."""

from shim.state.journal import KINDS, CorruptRecord, Journal, JournalScan, OpRecord

__all__ = ["KINDS", "CorruptRecord", "Journal", "JournalScan", "OpRecord"]
