"""The doctor: checks that prefix routing works against each replica (docs/doctor.md)."""
