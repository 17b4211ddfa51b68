"""`kvtune demo`: a live tiny engine in trouble, the operator walking the ladder, and a report."""
