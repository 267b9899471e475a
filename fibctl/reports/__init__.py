"""Reports from the results database: the study's tables and figures, read-only SQL, import.

Every table is a function of an engine that runs SQL and returns a `Table` (a pandas
DataFrame plus the query that produced it); rendering is separate (`render`).
"""
