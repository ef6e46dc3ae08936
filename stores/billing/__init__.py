"""Billing in ClickHouse: the usage writer, the reports analysts and tenants read, and the price table."""
