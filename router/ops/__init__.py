"""Operations: metrics, recording, the debug views and the decision lookups across workers."""
