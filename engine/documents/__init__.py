"""Documents and earlier conversations as memory: text extraction (extract), the token map back to file, page
and line (provenance), capsules read once and kept in the persistent tier (capsule), and a conversation's
attachments (attach). See DESIGN.md, "Documents as memory"."""
