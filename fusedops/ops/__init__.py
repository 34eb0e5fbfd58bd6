"""Registrations and public wrappers, one module per op family (imported only when the
extension that defines the operators is loaded)."""
