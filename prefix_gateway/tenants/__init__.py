"""Tenants: named clients with priorities, shares and budgets (docs/tenants.md)."""
