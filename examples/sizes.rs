//! Prints the sizes behind an identity-map entry (for BENCHMARKS.md).
fn main() {
    use sea_orm::{Value, sea_query::ValueTuple};
    println!(
        "Value {} ValueTuple {} TypeId {} Model {}",
        std::mem::size_of::<Value>(),
        std::mem::size_of::<ValueTuple>(),
        std::mem::size_of::<std::any::TypeId>(),
        std::mem::size_of::<entity::node::Model>()
    );
}
