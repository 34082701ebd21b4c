"""Run machinery: files written whole, the run layout, the ledger and ownership, stage plans, executors, the hub, limits and parts."""
