"""Report of a comparison: the tables (pandas), their CSV/XLSX files and the terminal summary."""
