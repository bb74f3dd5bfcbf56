"""The scaler and what it records: torch only (the config not even torch)."""
