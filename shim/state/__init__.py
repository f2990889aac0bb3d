"""podshim's durable state: the journal of in-flight operations (docs/design/crash-safety.md (Crash
safety))."""

from shim.state.journal import KINDS, CorruptRecord, Journal, JournalScan, OpRecord

__all__ = ["KINDS", "CorruptRecord", "Journal", "JournalScan", "OpRecord"]
