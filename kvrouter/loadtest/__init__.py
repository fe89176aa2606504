"""Load-test harness: workloads, drivers and reports comparing routing policies."""
