"""podshim's durable state: the journal of in-flight operations (DESIGN §8)."""

from shim.state.journal import KINDS, CorruptRecord, Journal, JournalScan, OpRecord

__all__ = ["KINDS", "CorruptRecord", "Journal", "JournalScan", "OpRecord"]
