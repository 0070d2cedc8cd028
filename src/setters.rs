//! Builder setters, written once: each line `name(arg: Type) => field = value;` (with its doc
//! comment) becomes `pub fn name(mut self, arg: Type) -> Self`, which sets `field` to `value` and
//! returns the builder.

/// See the module docs.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident($arg:ident: $ty:ty) => $field:ident = $value:expr;)*) => {$(
        $(#[$doc])*
        pub fn $name(mut self, $arg: $ty) -> Self {
            self.$field = $value;
            self
        }
    )*};
}
pub(crate) use setters;
