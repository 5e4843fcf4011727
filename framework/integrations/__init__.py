"""Model families from other libraries, each behind the model adapter seam
(framework/parallel/model.py): nothing outside an integration imports it, but the adapter
registry and the export format table."""
