// placeholder: filled by the issue-3 work
