"""replay/importers"""
