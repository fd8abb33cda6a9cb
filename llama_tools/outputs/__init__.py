"""Where output goes: paths checked before work, atomic writes and cleanup, tables, progress."""
