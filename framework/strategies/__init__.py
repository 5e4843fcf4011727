"""Strategy plugins: one module per plugin (see framework.plugins for the contract)."""
