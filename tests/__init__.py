"""kvrouter test suite."""
